"""One module per lab: ``labNN.py`` defines ``LAB``, a :class:`fa_lab.grading.registry.Lab`.

To add a lab: write ``solutions/labNN_<topic>.ipynb`` (metadata ``{"fa_lab": {"lab":
"labNN"}}``, solution code between ``# BEGIN SOLUTION`` and ``# END SOLUTION``),
then ``labNN.py`` here with its exercises (public cases, hidden cases drawn from a
generator, a judge per exercise built on :mod:`fa_lab.grading.judge`), and run
``fa-lab assign``. Helper modules of a lab are named ``labNN_<what>.py``.
Learner code may not call anything in this package (the grader flags it).
"""
