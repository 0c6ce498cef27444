"""Models made locally from what ships (nothing downloaded): the weaker drafts and random targets of a real shape.
(The tiny test VLMs are built by tests/models/.)"""
