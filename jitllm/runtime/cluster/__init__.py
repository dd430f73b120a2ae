"""A Ray cluster as more devices: connecting to it (`-cluster ADDRESS`), its nodes by name or id prefix,
each node's devices as `NODE/DEVICE` entries of the -devices grammar, and one actor per node that owns
its devices (jitllm.runtime.backends.ray_remote runs blocks there). docs/cluster.md."""
