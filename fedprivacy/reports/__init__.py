"""Everything that draws or writes documents: planning sheets, a run's progress figure, sweep reports.

Figures are `matplotlib.figure.Figure` objects saved with `Figure.savefig`: no pyplot and no
backend chosen at import, so importing fedprivacy never changes the matplotlib set-up of the
program that imports it. `fedprivacy.privacy` stays pure maths and never imports from here.
"""
