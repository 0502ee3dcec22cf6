"""wsseg flows."""
