"""LlamaIndex and LangChain adapters (thin; the core never imports them)."""
