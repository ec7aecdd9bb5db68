"""What a model family is, as data: where each family keeps its K/V weights (`architectures`) and
the vocabularies of the converter's options (`choices`). Standard library only; every other room
of the conversion reads these and nothing here imports them."""
