"""What the two encoder tasks share (``mlm`` pre-training and ``classify`` fine-tuning): the
encoder's model section and builder, and the SentencePiece vocabulary with [CLS], [SEP] and
[MASK]. Not a task itself: ``tasks/mlm`` and ``tasks/classify`` import it, not each other."""
