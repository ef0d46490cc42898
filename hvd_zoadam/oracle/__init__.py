"""The in-process oracle: P workers of the 1-bit exchange, of 0/1 Adam and of 1-bit Adam in
plain torch loops (:mod:`.simulate`), which the tests compare the real exchange against."""
