"""The torch-free core: errors, checkpoints and their metadata, architectures, permutation
specs and neuron vectors. Nothing here imports from any other part of fusekit."""
