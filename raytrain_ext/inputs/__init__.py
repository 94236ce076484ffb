"""Checks of what the user hands us (config values, paths, data, S3 settings), made on the
driver before Ray starts, and the one mapping of storage errors to the key that needs fixing."""
