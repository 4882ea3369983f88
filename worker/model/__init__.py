"""The model and its number formats: loading, Canteen's forward, linear layers, low-bit
weights."""
