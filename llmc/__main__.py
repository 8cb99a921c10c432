"""`python -m llmc` (and `torchrun ... -m llmc build RECIPE`): the llmc command."""

from llmc.cli import main

if __name__ == "__main__":
    main(prog_name="llmc")
