"""Data: trajectory storage (store: TFDS ArrayRecord without TensorFlow) and grain loaders
(loader: seeded shuffling, per-host sharding, packing, checkpointable iterators)."""
