"""SSH deployment of artifacts to devices (issue: edgepack deploy)."""
