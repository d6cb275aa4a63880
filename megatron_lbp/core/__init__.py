"""The pure core: no torch, no megatron-core (docs/architecture.md, "The layers")."""
