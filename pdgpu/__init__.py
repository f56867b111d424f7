"""pdgpu: the real PyTorch engine, checked live against pdref."""
