"""Deploy commands (edgepack deploy / devices / rollback / smoke) register on the main group here."""
