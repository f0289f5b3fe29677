"""Layer 0, torch-free: errors, request parameters and their validation, engine settings, prompt text."""
