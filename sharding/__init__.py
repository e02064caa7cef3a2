"""sharding: see ../shared/DESIGN.md (Code layout)."""
