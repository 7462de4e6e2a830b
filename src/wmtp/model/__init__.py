"""The tiny hybrid MTP models: generated with random weights, or trained on CPU."""
