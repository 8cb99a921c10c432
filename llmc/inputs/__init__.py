"""Reading what the user hands llmc: files read safely (files), escaped excerpts for error messages (excerpt),
module-name patterns matched in linear time (patterns)."""
