"""nn.Module wrappers of the ops."""
