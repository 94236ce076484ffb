"""Operations tooling: cluster diagnosis (``raytrain-ext doctor``) and run-time guards."""
