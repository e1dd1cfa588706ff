"""sandpiper."""
