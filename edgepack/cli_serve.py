"""`edgepack run` and the Python SDK commands register on the main group here."""
