"""Model architectures, one file each, as functions over a table of (pool) tensors."""
