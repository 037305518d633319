"""One module a family (its `FAMILY`: how its config reads into a spec, its tensors' names, its GGUF
architecture, its MTP layout); catalog.py's rows name them. Adding a family adds a module here and
a row there."""
