"""The Ray backend: pipeline devices in the processes of a ``jax.distributed`` world of
Ray actors, placed and supervised, exchanging values by compiled collectives."""
