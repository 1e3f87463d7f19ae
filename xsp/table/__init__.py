"""Records become the span table: ``build`` makes the rows, ``parents`` rebuilds the
parent/child tree (interval inclusion, launch correlation), ``walks`` are the tree walks every
later step uses, ``paths`` gives steps and the structural ``path`` key."""
