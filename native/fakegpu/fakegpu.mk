# placeholder: filled in by the fakegpu work
fakegpu:
	@true
