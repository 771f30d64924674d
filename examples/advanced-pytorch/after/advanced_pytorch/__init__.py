"""advanced_pytorch: A Flower / PyTorch app."""
