"""wsseg tasks."""
