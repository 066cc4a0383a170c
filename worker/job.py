"""The job's composition root (being written)."""
