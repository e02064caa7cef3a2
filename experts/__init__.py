"""experts: see ../shared/DESIGN.md (Code layout)."""
