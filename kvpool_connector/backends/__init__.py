"""Pool backends behind one interface (``Backend``), picked by name from a registry."""
