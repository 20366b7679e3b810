"""``flatzero bench device-memory``: peak device memory and bytes moved at init."""
