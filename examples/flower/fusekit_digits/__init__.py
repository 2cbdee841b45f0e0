"""A Flower app: one-shot federated learning on the digits data, fused by fusekit."""
