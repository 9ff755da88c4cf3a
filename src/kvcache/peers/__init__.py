"""The programs kvcache is measured beside (llama.cpp's tools, llama-server, transformers, kvpress,
redis-server), behind one interface: each runs in a process of its own, and its failure is a note
on a row, never a failed benchmark or evaluation. One module per peer; process.py and servers.py
are what they share."""
