"""Models made locally from what ships (nothing downloaded): the weaker drafts, the test VLM, random targets of a
real shape."""
