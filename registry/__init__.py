"""The model registry: model records in SQLite and the live worker directory."""
