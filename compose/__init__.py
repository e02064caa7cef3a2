"""compose: see ../shared/DESIGN.md (Code layout)."""
