"""Shared by the runtime and the offline tools: the rotation file format and loading, and the
names and paths of the embedded default model."""
