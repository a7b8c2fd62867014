"""The local backend: every pipeline device a mesh of JAX devices of this process, their
steps run on one thread, or as one program where they share their devices."""
