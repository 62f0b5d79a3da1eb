"""Placing a build's products in the output directory, whole or not at all, with a lock file."""
