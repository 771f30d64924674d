"""pytorchlightning_example: A Flower / PyTorch Lightning app."""
