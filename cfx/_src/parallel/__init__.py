"""Parallelism as rules and layer transforms: Megatron tensor parallelism, sequence parallelism (ring, Ulysses), pytree collectives of training state."""
