"""Reading data, one path from a source to the trainer's batches, shared by train, eval and convert.

In reading order:

1. `source.py`    `DataSource`: what to read (local files or a Hub dataset, streamed or whole;
                  how a .txt file is cut into documents: `text_unit`); `DataSource.validate`.
2. `documents.py` `documents(source)`: THE reader of text, a dataset with one column "text"
                  (one-line errors for unreadable files); `read_documents` (a list, for eval and
                  calibration); `split_documents` (a held-out share of whole documents).
3. `blocks.py`    `token_blocks(docs, tokenizer, seq_len)`: tokenized, joined with EOS, cut into
                  full blocks (cached on disk under the tokenizer's content); `first_blocks` (a
                  stream's first blocks as a fixed set), `require_blocks` (at least one block).
4. `schedule.py`  `schedule_blocks` (a seeded order of a whole dataset's blocks for the run's
                  budget) and `StreamSchedule` (the same for a stream, packed on the fly).

Beside them, `overlap.py`: documents known by their content (`document_digest`), so that eval and
the trainer warn when held-out text was a conversion's calibration text.

The trainer (`uptrain.train.setup.build_data`) follows 1 -> 4; eval, the demo, the method
bake-off and calibration (`uptrain.convert.layers.calibrate`) follow 1 -> 2 and score or run the
documents one by one (`uptrain.measure.eval.tokenize_texts`: no packing, no cache).
This package imports neither torch nor `datasets` until data is read (the CLIs' --help is fast).
"""

from uptrain.data.documents import documents, read_documents, split_documents
from uptrain.data.source import TEXT_UNITS, DataSource, TeacherSamples

__all__ = ["DataSource", "TeacherSamples", "TEXT_UNITS", "documents", "read_documents", "split_documents"]
