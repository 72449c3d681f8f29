# The seed's example job: group an uploaded CSV of transactions by category, sum it,
# and save a bar chart. /home/user/transactions.csv is uploaded with the job.
import pandas as pd
import matplotlib.pyplot as plt

df = pd.read_csv("/home/user/transactions.csv")
totals = df.groupby("category")["amount"].sum().sort_values(ascending=False)
print(totals.to_string())

ax = totals.plot.bar(color="#4c72b0", title="Spend by category, October 2026")
ax.set_ylabel("amount")
plt.tight_layout()
plt.savefig("/home/user/spend_by_category.png")
totals.round(2).to_dict()
