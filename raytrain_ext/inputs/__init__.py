"""Checks of what the user hands us (config values, paths, data, S3 settings), made on the
driver before Ray starts (storage errors are mapped to their key by ``storage.s3_errors``)."""
