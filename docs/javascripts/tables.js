// On phones every table row is shown as a card (docs/stylesheets/extra.css): each cell is
// labelled with its column's header, copied here into a data-label attribute. Code without
// spaces in a table (an identifier) is marked so that it is never broken mid-name. Material's
// instant navigation replaces the page without a reload, hence document$.
function labelTableCells() {
  for (const table of document.querySelectorAll(".md-typeset table:not([class])")) {
    const headers = [...table.querySelectorAll("thead th")].map((th) => th.textContent.trim());
    for (const row of table.querySelectorAll("tbody tr")) {
      [...row.children].forEach((cell, index) => {
        if (headers[index]) cell.setAttribute("data-label", headers[index]);
      });
    }
    table.setAttribute("data-cards", "");
    for (const code of table.querySelectorAll("code")) {
      if (!/\s/.test(code.textContent)) code.setAttribute("data-identifier", "");
    }
  }
}

if (typeof document$ !== "undefined") {
  document$.subscribe(labelTableCells);
} else {
  document.addEventListener("DOMContentLoaded", labelTableCells);
}
