"""Layer 7: what users run: the command line (`cli` and one module per command), the server, the benchmark, the
fidelity evaluation and the doctor."""
