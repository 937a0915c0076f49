"""Tools an agent loop calls, each one module: a class with verl's interface
(``base.BaseTool``). ``registry`` finds them by the class names a verl tool config uses."""
