"""Package data: see DESIGN.md."""
