"""Data: trajectory storage (store: TFDS ArrayRecord without TensorFlow), packing of examples
into rows (packing), and grain loaders (loader: seeded shuffling, per-host sharding,
checkpointable iterators)."""
