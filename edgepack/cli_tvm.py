"""TVM commands (edgepack tune) register on the main group here."""
