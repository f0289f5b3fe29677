"""`swiftdecode eval`: how faithful a forward is to the model, measured as llama.cpp's `llama-perplexity` measures
quantization (perplexity; KL divergence from a reference's next-token distributions; top-token agreement), with
llama.cpp's own figures on the same text beside ours."""
