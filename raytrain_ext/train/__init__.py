"""The per-worker training loop and what it needs: optimizer, schedule, digests."""
